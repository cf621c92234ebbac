"""peagle: P-EAGLE parallel speculative decoding on a CPU."""
from peagle import threads as _threads

# Before anything imports torch, whose OpenMP runtime reads these once: the thread count and a wait policy that
# does not spin away a busy core (peagle/threads.py; a value the user set wins).
_threads.apply_defaults()
