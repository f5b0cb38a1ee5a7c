"""Run configuration: schema, layering, presets and the rendered DeepSpeed JSON."""
