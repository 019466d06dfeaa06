"""shardwise"""
