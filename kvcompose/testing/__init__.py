"""The kvcompose test kit: build a real vLLM scheduler on CPU around a composition, no hardware."""
