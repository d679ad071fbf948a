"""Training recipe around real models (DeepSpeed/HF glue). Filled in by later issues."""
