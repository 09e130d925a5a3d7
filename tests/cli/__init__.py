"""The command line and the package: errors, demo and generate, packaging, the README's examples."""
