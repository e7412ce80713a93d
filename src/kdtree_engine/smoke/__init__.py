"""smoke"""
