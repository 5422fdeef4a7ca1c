"""An output folder's life: the commit protocol, readers' leases, opening and verifying an output, and the
`python -m formats.outputs.inspect` command line."""
