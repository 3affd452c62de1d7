"""HTTP routes, one module per resource; ``moorline.api.app.create_app`` mounts them."""
