"""DFlash / DFlash2 block drafters (speculative decoding): config, relax model, kernels, compile."""
