"""The modules that need a CUDA GPU throughout (marked ``cuda``; they skip without one). They span
layers: a kernel at real shapes, the model, graphs, TP on NCCL, ``phalanx serve`` on the GPU."""
