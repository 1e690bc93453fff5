"""The adapter kinds: `LoraDelta` (one pair), `LoraStack` (several in order), `LoraBank` (a
different entry per position), `DoraDelta` (PEFT's DoRA: a member with a row-factor epilogue),
`LoraExperts` (routed experts) and `AdapterSet` (named adapters in slots, hot swap).  They differ
in what they compute, not in how they reach the kernels: each is an entry of the one entry table
(`lora._entries`) and applies through the one edge (`lora._apply`)."""
