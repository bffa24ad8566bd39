"""inferlab"""
