"""Validation loss, validation images and their metrics, sample grids, and the generation they share."""
