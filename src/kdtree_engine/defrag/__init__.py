"""defrag"""
