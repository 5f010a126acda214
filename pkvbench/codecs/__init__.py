"""How a cache's values are stored: pure tensor code from values to their stored form and back (KIVI's integers), with
the bytes each form takes. No model: the engine's stored cache layers (engine/quantized.py) call it."""
