"""The thin adapter vLLM loads: the composed connector, its metadata types, registration, args."""
