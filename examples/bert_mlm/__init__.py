"""BERT masked-language modelling: model (bert.py) and data (data.py) entry points."""
