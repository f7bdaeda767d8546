"""The delivery pipeline: decode, isolate, run, settle, report (DESIGN.md "One delivery")."""
