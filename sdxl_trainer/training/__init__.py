"""The parts of an update: the data stream, the denoising objective, captions, the train step, the learning rate, the EMA."""
