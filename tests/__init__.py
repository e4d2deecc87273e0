"""The test suite, one folder a layer (as the packages are laid out), plus the GPU tests, the
product's end-to-end tests and the helpers they share."""
