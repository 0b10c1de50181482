"""Small pieces shared by the web pages (review, search) and the HTTP service: bearer auth, page chrome."""
