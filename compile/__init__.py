"""The compiler: HF model -> relax module with our TIR kernels -> library, weights and manifest."""
from . import inspect_cache

inspect_cache.install()
