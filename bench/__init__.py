"""Benchmarks and conformance runners built on top of schemas, constraints, decoding and agent."""
