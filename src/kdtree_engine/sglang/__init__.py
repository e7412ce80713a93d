"""sglang"""
