"""Running untrusted code in rootless Podman: `box` (the Sandbox API, its threat model and
the one execution path), `pool` (warm sandboxes shared by concurrent checks), `batch` (many
short runs in one exec), `runner` (a domain's view: run a program on inputs, get a verdict's
evidence), `owned` (a pool held by an actor for its lifetime), `image` (the image and
`reinforge sandbox doctor`), `selftest` (the hostile programs `reinforge sandbox selftest`
runs) and `cli`.
"""
