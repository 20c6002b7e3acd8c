-- Health probe. A script (not PING) so that it is held back exactly when
-- the bucket scripts would be, e.g. during CLIENT PAUSE WRITE.
return 1
