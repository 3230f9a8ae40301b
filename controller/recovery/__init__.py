"""Detection, diagnosis, recovery and fault injection (docs/RECOVERY.md)."""
