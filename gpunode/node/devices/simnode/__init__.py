"""The simulated GPU node: profiles, simulated GPUs with fault injection, and its control socket."""
