"""Rollouts over the SGLang API: the client (`client`), the server process a sampler, an
evaluator or a benchmark starts and owns (`server`), and the command line of the embedded
server (`command`, also used by the supervisor). The same client drives SGLang on a GPU and
`reinforge serve` on a CPU.
"""
