"""Reference points the public calibration leaves out of its fit, each with why. They stay in every table,
simulated with the fitted constants and marked excluded."""

EXCLUDED: dict[str, str] = {}
