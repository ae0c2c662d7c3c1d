# Makes ext/stopline a package for cimport: `from stopline cimport _ctransformers as ct`.
# The extension built from here is stopline._core (see setup.py).
