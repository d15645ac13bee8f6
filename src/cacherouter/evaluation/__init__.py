"""The offline evaluation: scripted workloads run under three request architectures."""
