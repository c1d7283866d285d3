"""Generated from proto/ by modalmesh/_protogen.py (make protos): do not edit."""
