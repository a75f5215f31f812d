"""The token bucket: rovers, their schedule, give-back, fences and the filler."""
