"""The pure layer: the wire protocol's state machine, its frames, requests and checks, the Host
and Origin rules, the vocabulary and the errors. No I/O: these modules import only the standard
library and each other (a test checks), so they are tested with plain function calls. The API
dialects (:mod:`stopline.api`) and structured output (:mod:`stopline.structured`) stand above it."""
