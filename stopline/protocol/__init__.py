"""The pure layer: the protocol's state machine, its frames, requests and checks, the OpenAI
field mapping, the tool-call and JSON grammars, the Host and Origin rules, the vocabulary and
the errors. No I/O: these modules import only the standard library and each other (a test
checks), so they are tested with plain function calls."""
