"""Kernel adapters, one module per backend; each declares its CAPABILITIES as data."""
