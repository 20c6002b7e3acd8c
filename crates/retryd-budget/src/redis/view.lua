-- View: the refilled budget, nothing saved.
refill()
return reply(0, nil)
