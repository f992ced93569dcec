"""The lab's devices and models: the GPU and model catalogs shipped in data/, and this machine's CPU profile
(`--gpu local-cpu`, written by `servelab lab profile`)."""
from servelab.lab.catalog.lookup import DATA_DIR, LOCAL_CPU, get_device, get_model, gpu_ids, model_ids

__all__ = ["DATA_DIR", "LOCAL_CPU", "get_device", "get_model", "gpu_ids", "model_ids"]
