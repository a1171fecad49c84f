"""Speculative decoding: proposers (MTP head, draft model) behind one interface, and the decoder
that runs a round (propose -> one batched verification -> accept) for the engine."""
