"""The API dialects beside the wire protocol: one module per API (OpenAI's fields, its Responses
API, Anthropic's Messages, Ollama's), each turning its request body into the one generate frame
and the one outcome back into its own shapes. They import the protocol and structured output,
never the servers. No I/O."""
