"""bench results: a run's JSON and markdown land under the results folder, in a sub-folder if the name holds one."""
import json

from servelab.bench.results import write_results


def test_write_results_makes_the_sub_folder_a_name_holds(tmp_path):
    json_path, md_path = write_results("quant/perplexity-x", {"command": "servelab bench perplexity"},
                                       [{"precision": "int8", "perplexity": 17.1}], out_dir=tmp_path)
    assert json_path == tmp_path / "quant" / "perplexity-x.json" and md_path.parent == tmp_path / "quant"
    assert json.loads(json_path.read_text())["name"] == "quant/perplexity-x"
    assert "| int8 |" in md_path.read_text()
