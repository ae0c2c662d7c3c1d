"""The engine side: the Python API over the native loop (:mod:`.loop`, both engines), the
tokenizers, the model files and their checks, models by name from the hub, and the llama.cpp
build with its edits. Nothing here is imported on loading the package, so the build
(setup.py) can import :mod:`.llama_build` before the native loop exists."""
