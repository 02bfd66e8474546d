"""Tools: the kvcert CLI and per-step traces (npz + JSON + plots)."""
