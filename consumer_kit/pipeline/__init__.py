"""The delivery pipeline: decode, isolate, run, settle, report (docs/explanation/one-delivery.md)."""
