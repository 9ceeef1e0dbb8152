"""Speculative decoding: proposers (n-gram prompt lookup, suffix decoding, a draft model)
offer up to k next tokens per sequence; the target model verifies them all in one forward and
keeps the longest run its own sampling agrees with (verify.py)."""
