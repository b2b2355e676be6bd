"""Real KV moving between real vLLM engines: the model maker, engine process nodes, the P/D flow
and the demo. Importing this package does not import vLLM; only the engine processes do."""
