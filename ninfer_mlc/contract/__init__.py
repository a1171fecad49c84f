"""What `ninfer compile` writes and the runtime reads: the artifact manifest, the pool layouts the
library's functions take, weight shard IO and the model's generation defaults.

Both sides import this package and nothing of each other (compile -> artifact -> runtime -> server).
It needs no TVM, so the server can inspect an artifact before loading anything heavy.
"""
