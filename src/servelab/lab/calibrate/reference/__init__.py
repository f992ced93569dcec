"""Fitting and validating against the published reference set: the fit, cross-validation by source, validation."""
