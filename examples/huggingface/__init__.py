"""A Hugging Face model trained by dstrain through a one-line adapter (model.py); needs transformers."""
