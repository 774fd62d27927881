"""Generated messages of protos/ssdrbm/inference/v2 (python scripts/gen_protos.py)."""
