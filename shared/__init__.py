"""What the frontend and the worker agree on: configs, SamplingParams, the wire protocol."""
