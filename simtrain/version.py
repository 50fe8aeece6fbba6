"""simtrain's version: one home, read by the package face and by report.json's `simtrain_version`."""
__version__ = "0.1.0"
