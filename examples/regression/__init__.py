"""Your own model and dataset through entry points: an MLP regressing a smooth function (model.py)."""
