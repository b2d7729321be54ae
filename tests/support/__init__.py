"""Helpers shared by test packages: small views over public store APIs (no private reads)."""
