"""Span and metric output: console rendering and providers built from the OTEL_* environment."""
