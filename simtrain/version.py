"""simtrain's version, in one place: the package face, report.json and pyproject.toml read it here.

    from simtrain.version import __version__
"""
__version__ = "0.1.0"
